"""What a profile can price: a CPU-expert policy needs the host's measured time around a CPU
layer's experts (`HardwareProfile.cpu_layer_unmeasured`). Apart from `cmoe.sim.run` so that the
GPU machine's scripts, which have no simpy, check a profile before their long build."""

from __future__ import annotations

from cmoe.core.errors import CmoeError
from cmoe.core.hw import HardwareProfile, load_profile
from cmoe.policy.policies import trait


def _refusal(profile: HardwareProfile, names: list[str]) -> CmoeError:
    them = ", ".join(names)
    return CmoeError(f"profile {profile.name} has no measured host time around a CPU layer's experts (cpu_lead_us "
                     f"and the rest: calibrated before cmoe fitted them, or with no CPU expert run inside the "
                     f"model), so it cannot price {them}: calibrate again (`cmoe calibrate`, its --policy naming "
                     f"them or all) or leave {them} out")


def check_cpu_layer(profile: HardwareProfile, policy: str) -> None:
    """Refuse a CPU-expert policy priced by a calibration without the host's time around a CPU
    layer (`HardwareProfile.cpu_layer_unmeasured`): its CPU layers would cost the experts alone."""
    priceable(profile, [policy], every=False)


def check_profile(profile: str, names) -> None:
    """Load the profile `profile` (a name or a file) and refuse, in one line, every policy of
    `names` it cannot price: what a long job (a build, a sweep) checks before it starts."""
    priceable(load_profile(profile), list(names), every=False)


def priceable(profile: HardwareProfile, names, every: bool) -> tuple[list[str], str | None]:
    """The policies of `names` this profile can price (`check_cpu_layer`). Where the user asked for
    every policy (`every`), the others are left out and a note says so; else all of them are named
    in one refusal. Nothing left to price is refused too."""
    left = [p for p in names if trait(p, "cpu_experts") and profile.cpu_layer_unmeasured()]
    kept = [p for p in names if p not in left]
    if left and (not every or not kept):
        raise _refusal(profile, left)
    note = (f"left out {', '.join(left)}: profile {profile.name} has no measured host time around a CPU "
            f"layer's experts (calibrate again with `cmoe calibrate`, its --policy naming them or all, to "
            f"price them)") if left else None
    return kept, note
