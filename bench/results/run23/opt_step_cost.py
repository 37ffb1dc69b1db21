import time, torch, torch.distributed as dist, sys
sys.path.insert(0, "bench")
from bench_models import spec_for, build_model
import fsdpfn.compat as fc
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
spec = spec_for("ln_mlp")
for mode in ["default", "foreach", "fused"]:
    model = build_model(spec, 0)
    for b in model.blocks: fc.fully_shard(b, mesh=mesh)
    fc.fully_shard(model, mesh=mesh)
    kw = {} if mode == "default" else {mode: True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)
    for p in model.parameters(): p.grad = torch.zeros_like(p)
    for _ in range(3): opt.step()
    t = time.perf_counter()
    for _ in range(20): opt.step()
    if dist.get_rank() == 0: print(mode, f"{(time.perf_counter()-t)/20*1e3:.2f} ms/step", sum(1 for _ in model.parameters()), "params")
dist.destroy_process_group()
