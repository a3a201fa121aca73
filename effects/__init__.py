"""See and change what happens inside any JAX computation."""

from importlib import metadata as _metadata

# `_rules` and `_custom` fill the rewriter's table of rules for higher-order
# primitives (`_rewrite.rules`); they import `_rewrite`, so the package
# imports them.
from . import _custom, _handle, _nnx, _rules  # noqa: F401
from ._grads import intermediate_grads as intermediate_grads
from ._handle import Found as Found
from ._handle import handle as handle
from ._handlers import (
    Append as Append,
)
from ._handlers import (
    Context as Context,
)
from ._handlers import (
    Handler as Handler,
)
from ._handlers import (
    Intervene as Intervene,
)
from ._handlers import (
    Names as Names,
)
from ._handlers import (
    Perturb as Perturb,
)
from ._handlers import (
    Reduce as Reduce,
)
from ._handlers import (
    Select as Select,
)
from ._handlers import (
    Substitute as Substitute,
)
from ._handlers import (
    Tag as Tag,
)
from ._modules import tag_modules as tag_modules
from ._nonfinite import BadSite as BadSite
from ._nonfinite import find_nonfinite as find_nonfinite
from ._primitives import perturb as perturb
from ._primitives import tag as tag
from ._site import Site as Site
from ._sites import SiteInfo as SiteInfo
from ._sites import Sites as Sites
from ._sites import sites as sites
from ._stats import Statistics as Statistics
from ._stats import Stats as Stats
from ._stats import Summary as Summary
from ._stats import summary as summary
from ._taps import TapInfo as TapInfo
from ._taps import taps as taps

# `handle` reaches Flax NNX objects through `_nnx`, an adapter (the core
# imports none).
_handle.adapters.append(_nnx)

try:
    __version__ = _metadata.version("effects-jax")
except _metadata.PackageNotFoundError:  # pragma: no cover
    __version__ = "0.0.0"
