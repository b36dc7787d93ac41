"""What a survivor serves of a sharded model: the state as its step began, never the model's
own ``state_dict()`` in the middle of a step (FSDP2 would swap its sharded parameters back
under the step running on the other thread)."""

import os
import socket
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist, torch.nn as nn
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{sys.argv[1]}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from xmig.worker.registry import Registry
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "dp_shard"))
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 2))
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    registry = Registry()
    registry.register(model=model, optimizer=optimizer)
    served = []
    # what a survivor's recovery thread does while the step is inside the model
    def serve(*_):
        served.append({k: v.clone() for k, v in registry.state_dict()["model"].items()})
    model[1].register_forward_hook(serve)
    x = torch.randn(4, 8)
    for step in range(3):
        registry.at_boundary(step)
        at_start = {k: v.to_local().clone() if hasattr(v, "to_local") else v.clone()
                    for k, v in model.state_dict().items()}
        model(x).sum().backward()  # must not fail: the served state touched nothing
        optimizer.step()
        optimizer.zero_grad()
        assert set(served[-1]) == set(at_start)
        assert all(torch.equal(served[-1][k], at_start[k]) for k in at_start), step
    print("ok", len(served))
""")


def test_a_sharded_models_state_is_served_from_the_steps_start_without_touching_it(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(port)], capture_output=True,
                          text=True, timeout=120, env={**os.environ}, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "3"]
