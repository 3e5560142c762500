"""`auto` options answered by the planners: an EnginePlan whose layout is "auto", or a DEP layout with "auto" fields,
becomes a concrete one, with the decision (chosen plan, runner-ups with predicted times, what would change the
choice) kept as text for `--explain`. Planners read the profile of the devices present (moejax.plan.resolve);
nothing here touches a device beyond asking what kind and how many there are."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from moejax.config import ModelConfig
from moejax.layout import Layout
from moejax.plan.engine_plan import EnginePlan
from moejax.plan.findep_online import ONLINE_FIELDS
from moejax.plan.hardware import Profile
from moejax.plan.layouts import choose_layout, dep_option

# profile fields whose scaling may flip a decision, and how they read
LAYOUT_WHAT_IF = (("d2d.bandwidth", "device-to-device bandwidth"), ("all_to_all.bandwidth", "all-to-all bandwidth"),
                  ("all_gather.bandwidth", "all-gather bandwidth"), ("device.flops", "device compute rate"))
PLACEMENT_WHAT_IF = (("h2d.bandwidth", "host-to-device bandwidth"), ("device.flops", "device compute rate"))
FACTORS = (0.125, 0.25, 0.5, 2.0, 4.0, 8.0)


def what_would_change(decide: Callable[[Profile], str], profile: Profile, chosen: str,
                      what_if: Sequence[tuple[str, str]] = LAYOUT_WHAT_IF) -> list[str]:
    """For each field of `what_if`, the smallest scaling (of FACTORS) that makes `decide(profile) -> choice`
    choose something else, as text."""
    out = []
    for field, words in what_if:
        obj, name = field.split(".")
        base = getattr(getattr(profile, obj), name)
        for factor in sorted(FACTORS, key=lambda f: max(f, 1 / f)):
            other = decide(profile.with_overrides({field: base * factor}))
            if other != chosen:
                out.append(f"{words} x{factor:g} would choose {other}")
                break
    return out or [f"no scaling of {', '.join(w for _, w in what_if)} by {min(FACTORS):g}..{max(FACTORS):g}x "
                   "changes it"]


def plan_layout(cfg: ModelConfig, plan: EnginePlan, profile: Profile, devices: int) -> tuple[EnginePlan, str]:
    """-> (the plan with a concrete layout, the decision as text)."""
    w = plan.workload
    if plan.layout == "auto":
        choice = choose_layout(cfg, profile, devices, w.tokens, w.seq_len)
        changes = what_would_change(lambda p: choose_layout(cfg, p, devices, w.tokens, w.seq_len).best.spec,
                                    profile, choice.best.spec)
        text = choice.describe() + "\n  what would change it: " + "; ".join(changes)
        chosen = Layout.parse(_spec(choice.best.spec))
        if chosen.experts == "dep":  # nothing was pinned: every step's shape gets its own (r1, r2, order)
            chosen = dataclasses.replace(chosen, online=ONLINE_FIELDS)
        return dataclasses.replace(plan, layout=chosen), text
    fixed = plan.layout  # a DEP layout with auto fields
    assert isinstance(fixed, Layout)  # EnginePlan parsed it
    option, dep = dep_option(cfg, profile, devices, w.tokens, w.seq_len, fixed)
    if dep is None:
        raise ValueError(f"moejax.load: layout {fixed}: {option.why}")
    changes = what_would_change(lambda p: dep_option(cfg, p, devices, w.tokens, w.seq_len, fixed)[0].spec, profile,
                                option.spec)
    text = (f"DEP {', '.join(fixed.auto_fields)}=auto: " + dep.describe() + "\n  what would change it: " +
            "; ".join(changes))
    online = tuple(f for f in fixed.auto_fields if f in ONLINE_FIELDS)  # re-solved per step shape
    return dataclasses.replace(plan, layout=dataclasses.replace(Layout.parse(_spec(option.spec)), online=online)), text


def _spec(resolved: str) -> str:
    """A resolved layout's text minus its device count (the loader resolves it again)."""
    return ",".join(p for p in resolved.split(",") if not p.startswith("devices="))
