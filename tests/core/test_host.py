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


DS_GAS, DS_STEPS, DS_NAN_AT = 2, 5, 5  # rank 0's micro-batch 5 (step 3) has a NaN input: a commit is skipped


def _deepspeed_commit_effects(monitor_dir):
    """A real ACCO DeepSpeed engine (fp16, dynamic loss scale, an LR scheduler, DeepSpeed's csv
    monitor, ACCO's metrics to the monitor and the log) with every effect of a commit recorded where
    it lands: the loss scaler's update, the event, the progress line, DeepSpeed's held per-step
    figures (``booked``), ACCO's monitor events and log line, each with the step counters and the
    scheduler's ``last_epoch`` seen then."""
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    import ds_acco
    from fixtures import TinyNet, batch, ds_config, make_optimizer
    from lr_workers import FP16

    get_accelerator().is_fp16_supported = lambda: True  # torch's CPU fp16 kernels run TinyNet
    acco = {"enabled": True, "mode": "acco", "metrics": {"monitor": True, "log_every": 1}}
    model = TinyNet(seed=0)
    opt = make_optimizer("adamw")(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
    engine, _, _, _ = ds_acco.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config(
        DS_GAS, acco, fp16=FP16, steps_per_print=1,
        csv_monitor={"enabled": True, "output_path": monitor_dir, "job_name": "host"}))
    rank = dist.get_rank()
    host, zero = engine.optimizer.driver.host, engine.optimizer
    effects = []

    def seen():
        return engine.global_steps, engine.skipped_steps, sched.last_epoch

    def wrap(obj, name, note):
        original = getattr(obj, name)

        def recorded(*args):
            effects.append(note(*args) + seen())
            return original(*args)
        setattr(obj, name, recorded)

    update = zero._acco_update_loss_scale

    def update_loss_scale(skipped):
        scale = update(skipped)
        effects.append(("loss_scale", skipped, scale) + seen())
        return scale
    zero._acco_update_loss_scale = update_loss_scale
    wrap(host, "on_commit", lambda e: ("on_commit", e.step, e.skipped, e.loss_scale, e.lr_scheduler))
    wrap(engine, "_report_progress", lambda step: ("progress", step))
    wrap(engine.monitor, "booked", lambda x: ("booked", x))
    wrap(host, "log", lambda line: ("log", line.split(" | ")[0]))
    inner = engine.monitor.monitor  # DeepSpeed's MonitorMaster: ACCO's events are recorded, DeepSpeed's not
    write = inner.write_events

    def write_events(events):
        if any(name.startswith("ACCO/") for name, _, _ in events):
            effects.append(("acco_events", sorted({x for _, _, x in events})) + seen())
        return write(events)
    inner.write_events = write_events
    dtype = next(engine.module.parameters()).dtype
    for i in range(DS_GAS * DS_STEPS):
        x, y = batch(rank, i)
        if i == DS_NAN_AT and rank == 0:
            x = x.clone()
            x[0, 0] = float("nan")
        engine.backward(engine(x.to(dtype), y.to(dtype)))
        engine.step()
    engine.destroy()  # the last commit is collected here
    return {"effects": effects, "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
            "global_samples": engine.global_samples}


def test_a_deepspeed_engine_books_each_commit_once_in_the_hosts_order(tmp_path):
    """Each commit reaches the host as exactly one CommitEvent, after the loss scaler's update and
    the LR bookkeeping (a skipped step's scheduler step undone before the event), and the engine's
    effects come in the Host protocol's order: skipped_steps, the progress line and DeepSpeed's held
    figures (global_steps not yet advanced, global_samples with this step), global_steps, then
    ACCO's monitor events and log line (rank 0)."""
    from fixtures import MICRO
    outs = run_ranks(_deepspeed_commit_effects, world=2, monitor_dir=str(tmp_path), timeout=scaled(180))
    for rank, out in enumerate(outs):
        effects = out["effects"]
        updates = [e for e in effects if e[0] == "loss_scale"]
        assert len(updates) == out["global_steps"] == DS_STEPS
        expected, skipped = [], 0
        for t, (_, s, scale, steps, skipped_before, epoch) in enumerate(updates, start=1):
            assert (steps, skipped_before) == (t - 1, skipped)
            after_lr = epoch - s  # a skipped step's scheduler step, taken at its launch, is undone
            skipped += s
            x = t * DS_GAS * 2 * MICRO  # every micro-batch of both ranks, MICRO samples each
            expected += [("loss_scale", s, scale, t - 1, skipped - s, epoch),
                         ("on_commit", t, s, scale, "undone" if s else "kept", t - 1, skipped - s, after_lr)]
            if rank == 0:
                expected.append(("progress", t, t - 1, skipped, after_lr))
            expected.append(("booked", x, t - 1, skipped, after_lr))
            if rank == 0:
                expected += [("acco_events", [x], t, skipped, after_lr), ("log", f"ACCO step {t}", t, skipped, after_lr)]
        assert effects == expected
        assert skipped == out["skipped_steps"] >= 1  # the NaN micro-batch's commit was skipped on every rank
        assert out["global_samples"] == DS_STEPS * DS_GAS * 2 * MICRO
