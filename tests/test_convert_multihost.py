"""``kdsa convert hf-to-orbax --mesh`` as a 2-process job (``kdsa launch-local``, 2 CPU devices
each, gloo): each process reads only the slices of the source tensors that its devices hold,
and the checkpoint equals the one-process conversion onto the same mesh shape. One bounded
launch of the micro K3 model from ``test_convert.py``.
"""

import re
import subprocess
import sys

import jax
import numpy as np
from flax import nnx

from kdsa.model import checkpoint as ckpt
from kdsa.sharding.mesh import make_mesh
from kdsa.train import convert

from launch_env import launch_env
from model_fixtures import MICRO, random_params

MESH = "fsdp=2,expert=2"


def test_two_processes_read_their_slices_and_write_the_same_checkpoint(tmp_path):
    src = ckpt.save_params(tmp_path / "micro", MICRO, random_params(MICRO, 0))
    hf = tmp_path / "hf"
    convert.orbax_to_hf(src, hf, layout="kimi_k3", progress=False)
    mesh = make_mesh(MESH, devices=jax.devices()[:4])
    one = convert.hf_to_orbax(hf, tmp_path / "one", mesh=mesh, progress=False)

    cmd = [sys.executable, "-m", "kdsa.cli.main", "launch-local", "--processes", "2",
           "--devices-per-process", "2", "--timeout", "100", "--", "convert", "hf-to-orbax",
           str(hf), str(tmp_path / "two"), "--mesh", MESH, "--no-progress"]
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    read = {int(p): int(n) for p, n in re.findall(
        r"process (\d) of 2 read (\d+) bytes of tensor slices", proc.stdout)}
    assert sorted(read) == [0, 1], proc.stdout[-2000:]
    # one process reads every device's slice once (replicated parameters once); two processes
    # split the sharded slices between them and each reads the replicated parameters itself
    assert all(0 < n < one.bytes_sliced for n in read.values()), (read, one.bytes_sliced)
    assert read[0] + read[1] >= one.bytes_sliced
    assert max(read.values()) < 0.75 * one.bytes_sliced, (read, one.bytes_sliced)

    dev = jax.sharding.make_single_device_sharding(jax.devices()[0])
    targets = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=dev) for k, v in
               ckpt.flat_variables(nnx.state(ckpt.abstract_model(MICRO))).items()}
    a, b = (ckpt.load_params(tmp_path / d, targets) for d in ("one", "two"))
    for k in targets:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    _, info = ckpt.read_info(tmp_path / "two")
    assert info["source"]["layout"] == "kimi_k3"
