"""Combine a fidelity run's held-out curve (loss per optimizer step, equal tokens) with a sweep's
step times: time to a target loss and the held-out loss at equal wall-clock, per sweep point.

    python scripts/time_to_target.py FIDELITY_SUMMARY.json SWEEP.json

Time to target = the first evaluated step at or below the target (stock's last held-out loss + 1%)
× the variant's step time. Loss at equal wall-clock: at the time the faster of stock and ACCO
fixed reaches the fidelity run's last step, each one's loss interpolated on its curve.
"""
import json
import sys


def main(fidelity_path: str, sweep_path: str) -> None:
    variants = json.load(open(fidelity_path))["variants"]
    curve = {k: [(h["step"], h["loss"]) for h in v["heldout_curve"]] for k, v in variants.items()}
    last = curve["stock"][-1][0]
    target = 1.01 * curve["stock"][-1][1]

    def steps_to_target(name):
        return next((s for s, loss in curve[name] if loss <= target), None)

    def loss_at(name, step):
        for (s0, l0), (s1, l1) in zip(curve[name], curve[name][1:]):
            if s0 <= step <= s1:
                return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
        return None

    sweep = json.load(open(sweep_path))
    points = sweep["medians"] if isinstance(sweep, dict) else sweep
    reach = {k: steps_to_target(k) for k in curve}
    print(f"target {target:.4f}; steps to target: " + ", ".join(f"{k} {v}" for k, v in reach.items()))
    print("| ranks | ratio | time to target: stock / fixed (fixed's gain) | held-out loss at equal wall-clock: stock / fixed |")
    print("|---|---|---|---|")
    for p in points:
        st, fx = p["stock"]["step_s"], p["fixed"]["step_s"]
        t = last * min(st, fx)
        tts, ttf = reach["stock"] * st, reach["fixed"] * fx
        print(f"| {p['world']} | {p['ratio']:.2f} | {tts:.0f} s / {ttf:.0f} s ({tts / ttf:.2f}×) | "
              f"{loss_at('stock', t / st):.4f} / {loss_at('fixed', t / fx):.4f} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
