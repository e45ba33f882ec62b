"""tools/gpu_check.sh, read on the CPU: its steps fit in 5 minutes and 8 result files, and
everything it runs exists."""
import re
import subprocess
from pathlib import Path

from _shared import ROOT

SCRIPT = Path(ROOT) / 'tools' / 'gpu_check.sh'


def test_script_parses_and_its_limits_add_up_to_five_minutes():
    assert subprocess.run(['bash', '-n', str(SCRIPT)]).returncode == 0
    text = SCRIPT.read_text()
    limits = [int(n) for n in re.findall(r'run_step \w+ (\d+) "\$OUT', text)]
    limits += [int(n) for n in re.findall(r'\btimeout (\d+) ', text)]
    # The sanitizer step runs once per tool.
    tools = re.search(r'for tool in ([\w ]+); do', text).group(1).split()
    assert tools == ['memcheck', 'racecheck', 'synccheck', 'initcheck']
    sanitizer = int(re.search(r'run_step "sanitizer \$tool" (\d+)', text).group(1))
    total = sum(limits) + len(tools) * sanitizer
    assert total <= 300, total


def test_every_file_it_runs_exists_and_at_most_eight_results_come_back():
    text = SCRIPT.read_text()
    for path in set(re.findall(r'((?:tests|benchmarks)/[\w/]+\.py)', text)):
        assert (Path(ROOT) / path).is_file(), path
    results = set(re.findall(r'\$OUT/([\w.]+)', text))
    removed = set(re.findall(r'rm -f "\$OUT/([\w.]+)"(?: "\$OUT/([\w.]+)")?', text))
    removed = {name for pair in removed for name in pair if name}
    assert len(results - removed) <= 8, sorted(results - removed)
    assert {'backbones_', 'kernel_times.md', 'ncu.txt', 'sanitizer.txt'} <= results
    # The backbone results are named by the card the check ran on.
    assert '"$OUT/backbones_${card:-gpu}.json"' in text
