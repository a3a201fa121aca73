"""See and change what happens inside any JAX computation."""

import importlib.metadata

from ._handle import handle as handle, intermediate_grads as intermediate_grads
from ._handlers import (
    Handler as Handler,
    Intervene as Intervene,
    Perturb as Perturb,
    Reduce as Reduce,
    Substitute as Substitute,
    Tag as Tag,
)
from ._primitives import perturb as perturb, tag as tag

try:
    __version__ = importlib.metadata.version("effects")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover
    __version__ = "0.0.0"
