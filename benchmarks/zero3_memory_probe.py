"""ZeRO-3 memory probe (RESULTS, "A 404M-parameter GPT on 4 ranks"): ``shardwise run -n 4 benchmarks/zero3_memory_probe.py``
— the 404M GPT built on meta under sw.zero(stage=3), one forward/backward/step twice; rank 0 prints VmRSS/VmHWM."""
import functools, torch, shardwise as sw, time
from shardwise.models.gpt import GPT, GPTConfig, lm_loss
def mem(tag):
    d = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmHWM", "VmRSS")): d[line.split(":")[0]] = int(line.split()[1]) // 1024
    if w.rank == 0: print(f"{tag:28s} rss {d['VmRSS']} MiB  hwm {d['VmHWM']} MiB", flush=True)
w = sw.init(); mesh = sw.Mesh(dp=4)
mem("bare")
cfg = GPTConfig(vocab_size=50257, n_embd=1024, n_layer=28, n_head=16, block_size=128)
torch.manual_seed(0)
with torch.device("meta"): m = GPT(cfg)
mem("meta built")
model, opt = sw.zero(m, mesh, stage=3, optimizer=functools.partial(torch.optim.SGD, lr=0.01),
                     units=[[f"blocks.{i}"] for i in range(28)])
mem("zero3 built")
x = torch.randint(0, 50257, (1, 128)); y = x.roll(1)
out = model(x); mem("forward")
loss = lm_loss(out, y); loss.backward(); mem("backward")
opt.step(); opt.zero_grad(); mem("step")
out = model(x); lm_loss(out, y).backward(); opt.step(); mem("step 2")
