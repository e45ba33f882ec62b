"""Variant names of ``--variants`` and the backbone ``attn_cfg`` each one stands for."""
import math

from ..ops import DEFAULT_NS_ITERS

#: The named variants: ``attn_cfg`` overrides of the backbone's defaults (Laplacian
#: kernel, injective map, Newton–Schulz, λ = 4).
NAMED_VARIANTS = {
    'default': {},
    # The control: no Nyström term, only the local 3×3 term (LaplacianAttention).
    'noglobal': {'global_term': False},
    'gaussian': {'kernel': 'gaussian'},
    'none': {'normalize': 'none'},
    'exact': {'solver': 'exact'},
    'cg': {'solver': 'cg'},
    # The paper's comparison: CG given as many iterations as Newton–Schulz.
    'cg_capped': {'solver': 'cg', 'iters': DEFAULT_NS_ITERS},
}
#: Always run, first, whatever ``--variants`` lists.
ALWAYS = ('default', 'noglobal')
LAM_PREFIX = 'lam='


def _lam_variants(token):
    out = []
    for text in token[len(LAM_PREFIX):].split(','):
        try:
            lam = float(text)
        except ValueError:
            lam = math.nan
        if not 0 < lam < math.inf:
            raise ValueError(f'--variants: {token!r} must be lam= followed by positive '
                             f'numbers separated by commas (e.g. lam=1,2,8), got {text!r}')
        out.append((f'lam={lam:g}', {'lam': lam}))
    return out


def parse_variants(tokens):
    """``--variants`` tokens (names or ``lam=V1,V2,...``) -> [(name, attn_cfg)],
    :data:`ALWAYS` first, no repeats."""
    if isinstance(tokens, str):
        tokens = tokens.split()
    parsed = [(name, dict(NAMED_VARIANTS[name])) for name in ALWAYS]
    for token in tokens:
        if token.startswith(LAM_PREFIX):
            parsed.extend(_lam_variants(token))
        elif token in NAMED_VARIANTS:
            parsed.append((token, dict(NAMED_VARIANTS[token])))
        else:
            raise ValueError(f'--variants: unknown variant {token!r}; allowed: '
                             f'{", ".join(NAMED_VARIANTS)} or lam=V1,V2,... (positive '
                             f'numbers)')
    return list(dict(parsed).items())  # a name stands for one attn_cfg
