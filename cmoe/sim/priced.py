"""What a profile can price: a CPU-expert policy needs the host's measured time around a CPU
layer's experts (`HardwareProfile.cpu_layer_unmeasured`). Apart from `cmoe.sim.run` so that the
GPU machine's scripts, which have no simpy, check a profile before their long build."""

from __future__ import annotations

from cmoe.core.errors import CmoeError
from cmoe.core.hw import HardwareProfile
from cmoe.policy.policies import trait


def check_cpu_layer(profile: HardwareProfile, policy: str) -> None:
    """Refuse a CPU-expert policy priced by a calibration without the host's time around a CPU
    layer (`HardwareProfile.cpu_layer_unmeasured`): its CPU layers would cost the experts alone."""
    if trait(policy, "cpu_experts") and profile.cpu_layer_unmeasured():
        raise CmoeError(f"profile {profile.name} has no measured host time around a CPU layer's experts "
                        f"(cpu_lead_us and the rest: calibrated before cmoe fitted them, or on a model without CPU "
                        f"copies of the experts), so it cannot price {policy}: calibrate again (`cmoe calibrate`) "
                        f"or leave {policy} out")


def priceable(profile: HardwareProfile, names, every: bool) -> tuple[list[str], str | None]:
    """The policies of `names` this profile can price (`check_cpu_layer`). Where the user asked for
    every policy (`every`), the others are left out and a note says so; else the first is refused."""
    left = [p for p in names if trait(p, "cpu_experts") and profile.cpu_layer_unmeasured()]
    if left and not every:
        check_cpu_layer(profile, left[0])
    note = (f"left out {', '.join(left)}: profile {profile.name} has no measured host time around a CPU "
            f"layer's experts (calibrate again with `cmoe calibrate` to price them)") if left else None
    return [p for p in names if p not in left], note
