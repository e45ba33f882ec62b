"""tools/gpu_check.sh, read on the CPU: its limits, result files and commands."""
import re
import subprocess
from pathlib import Path

from _shared import ROOT

SCRIPT = Path(ROOT) / 'tools' / 'gpu_check.sh'


def code_lines(text):
    """The script's lines outside comments and the Python it feeds to "$PY" - <<'EOF'."""
    text = re.sub(r"<<'EOF'\n.*?\nEOF\n", '\n', text, flags=re.S)
    return [line for line in text.splitlines() if not line.lstrip().startswith('#')]


def test_every_limit_is_twice_the_cold_estimate_and_the_check_ends_within_6_minutes():
    assert subprocess.run(['bash', '-n', str(SCRIPT)]).returncode == 0
    text = SCRIPT.read_text()
    table = {name: (int(cold), int(limit)) for name, cold, limit in
             re.findall(r'^# \| (\w+) +\| +(\d+) +\| +(\d+) +\|', text, re.M)}
    limits = {name.lower(): int(value) for name, value in
              re.findall(r'\bLIMIT_([A-Z]+)=(\d+)', text)}
    assert limits == {name: limit for name, (_, limit) in table.items()}
    assert all(limit >= 2 * cold for cold, limit in table.values()), table
    assert sum(limits.values()) <= 360, sum(limits.values())
    # Every command under a limit of the table (the sanitizer's four tools run at once).
    timeouts = [line for line in code_lines(text) if re.search(r'\btimeout\b', line)]
    assert timeouts and all(re.search(r'\btimeout "\$(limit|LIMIT_[A-Z]+)"', line)
                            for line in timeouts), timeouts
    assert re.search(r'run_timed\(\) \{.*?\n    timeout "\$limit"', text, re.S)
    assert re.search(r'timeout "\$LIMIT_SANITIZER" compute-sanitizer .*&$', text.replace(
        '\\\n', ' '), re.M)


def test_every_file_it_runs_exists_and_at_most_eight_results_come_back():
    text = SCRIPT.read_text()
    for path in set(re.findall(r'((?:tests|benchmarks)/[\w/]+\.py)', text)):
        assert (Path(ROOT) / path).is_file(), path
    results = set(re.findall(r'\$OUT/([\w.]+)', text))
    assert len(results) <= 8, sorted(results)
    assert {'backbones_', 'kernel_times.md', 'ncu.txt', 'sanitizer.txt'} <= results
    # The backbone results are named by the card the check ran on.
    assert '"$OUT/backbones_$(cat "$STATE/card").json"' in text


def test_the_wheels_it_installs_are_ignored_by_git():
    folder = re.search(r'^WHEELS="\$\{WHEELS:-(\w+)\}"', SCRIPT.read_text(), re.M).group(1)
    assert f'/{folder}/' in (Path(ROOT) / '.gitignore').read_text().splitlines()
