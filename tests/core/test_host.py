"""The driver needs nothing from an adapter but a host (core/lifecycle/host.py): a plain test host over one
flat buffer group and a torch optimizer trains ACCO on 2 ranks, and the driver books every commit
on it: the step counters, the host's per-commit bookkeeping (before global_steps moves on), the
loss scale, the LR scheduler (stepped once per applied commit, a skipped commit's step undone) and
rank 0's banner."""
from dist import run_ranks
from timeouts import scaled

GAS, STEPS, N = 4, 6, 8
NONFINITE_AT = 13  # a micro-batch of a step after the bootstrap: its commit is skipped


class _TestHost:
    """The smallest :class:`ds_acco.core.lifecycle.host.Host`: attributes and methods, no framework."""

    framework = "test host"
    model_parallel_group = None
    accelerator = None
    monitor = None

    def __init__(self, groups, optimizer, scheduler, device):
        self.groups, self.optimizer, self.scheduler, self.device = groups, optimizer, scheduler, device
        self.process_group = None
        self.gradient_accumulation_steps, self.clip_grad, self.sum_ranks = GAS, 0.0, False
        self.global_steps = self.skipped_steps = 0
        self.events = []

    @property
    def global_samples(self):
        return self.global_steps

    def loss_scale(self):
        self.events.append("loss_scale")
        return None

    def update_loss_scale(self, skipped):
        self.events.append(("update_loss_scale", skipped))
        return None

    def lr_scheduler(self):
        return self.scheduler

    def step_lr_scheduler(self):
        self.scheduler.step()
        self.events.append(("lr_step", self.scheduler.last_epoch))
        return None

    def on_commit(self, event):
        self.events.append(("after_commit", self.global_steps, event.skipped, event.step))
        self.skipped_steps += event.skipped
        self.global_steps += 1

    def log(self, line):
        self.events.append(("log", line))

    def announce(self, line):
        self.events.append(("announce", line))


def _train_with_a_test_host():
    import torch
    import torch.distributed as dist

    from ds_acco.config import AccoConfig
    from ds_acco.core.round.buffers import FlatBuffers
    from ds_acco.core.driver import AccoDriver

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    live, grads = torch.zeros(N), torch.zeros(N)
    master = torch.nn.Parameter(live.narrow(0, rank * N // world, N // world).clone())
    optimizer = torch.optim.SGD([master], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    group = FlatBuffers(live, grads, master, rank=rank, world=world, comm_dtype=torch.float32)
    host = _TestHost([group], optimizer, scheduler, live.device)
    driver = AccoDriver(AccoConfig(enabled=True, mode="acco"), host)
    target = torch.arange(N, dtype=torch.float32)
    for i in range(STEPS * GAS):
        driver.before_backward()
        grads.add_((live - target) / GAS)  # d/dw of |w - target|^2 / 2, the loss scaled by 1/A
        if i == NONFINITE_AT and rank == 0:
            grads[0] = float("inf")
        with driver.micro_batch(1.0) as ends:
            if ends:
                driver.end_phase()
    driver.drain()
    driver.close()
    return {"events": host.events, "global_steps": host.global_steps, "skipped_steps": host.skipped_steps,
            "last_epoch": scheduler.last_epoch, "weights": live.tolist()}


def test_a_test_host_is_all_the_driver_needs():
    for rank, out in enumerate(run_ranks(_train_with_a_test_host, world=2, timeout=scaled(120))):
        events = out["events"]
        commits = [e for e in events if e[0] == "after_commit"]
        # one commit per optimizer step (and the one in flight, drained), each booked before global_steps moves on
        assert len(commits) == out["global_steps"] >= STEPS - 1
        assert [c[1] for c in commits] == list(range(len(commits)))
        assert [c[3] for c in commits] == list(range(1, len(commits) + 1))  # the metrics record's step
        skipped = sum(c[2] for c in commits)
        assert skipped == out["skipped_steps"] == 1, commits
        # the loss scaler is updated once per commit, told whether it was skipped, in the same order
        assert [e[1] for e in events if e[0] == "update_loss_scale"] == [c[2] for c in commits]
        assert "loss_scale" in events  # G's scale is asked for (None: 1)
        # stepped for every launched commit, the skipped one's step undone: stock's count
        assert out["last_epoch"] == out["global_steps"] - skipped
        announced = [e[1] for e in events if e[0] == "announce"]
        assert (announced[0].startswith("ACCO is on (test host): mode=acco, 2 micro-batches per phase")
                if rank == 0 else announced == []), announced
        assert all(abs(w) < 1e3 for w in out["weights"])  # the skipped step's inf never reached the weights
