"""adaptipe: adaptive pipeline-parallel training for PyTorch.

Plans are data: `Profile`, `Partition` and `Schedule` are plain, versioned,
JSON-serialisable types that every CLI step writes and reads.
"""

from __future__ import annotations

from pathlib import Path

# In a source checkout controllers/, envs/ and models/ sit beside this folder and are
# mapped to adaptipe.* by pyproject's package-dir. When the checkout itself is on
# sys.path (python run from the repository root), extend the package path so those
# sub-packages still resolve; installed copies never take this branch.
_root = Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "models" / "__init__.py").is_file():
    __path__.append(str(_root))

from adaptipe.errors import AdaptipeError, PlanError  # noqa: E402
from adaptipe.plan.partition import Partition  # noqa: E402
from adaptipe.profile.types import LayerProfile, Profile  # noqa: E402
from adaptipe.schedule.types import Schedule  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AdaptipeError",
    "LayerProfile",
    "Partition",
    "PlanError",
    "Profile",
    "Schedule",
    "__version__",
]
