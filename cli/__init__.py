"""kdsa.cli: the ``kdsa`` command (``main.py``) and one module per subcommand; argument parsing
and one-line errors only, the work is done by the library packages.

On a host with no accelerator device files (no TPU ``/dev/accel*`` / ``/dev/vfio/N``, no GPU
``/dev/nvidia0`` / ``/dev/kfd``) and no ``JAX_PLATFORMS`` set, the command runs JAX on the CPU
backend without probing the TPU plugin: with ``libtpu`` installed (the test extra, for the TPU
compile checks) that probe otherwise logs TPU discovery errors at every start. Abstract TPU
topologies (``kdsa plan --compile``) work either way.
"""

import glob
import os


def _no_accelerator() -> bool:
    return not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
                or os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd"))


if "JAX_PLATFORMS" not in os.environ and _no_accelerator():
    os.environ["JAX_PLATFORMS"] = "cpu"
