"""An OpenAI-compatible server that behaves like vLLM in time, for demos and tests without a GPU.

The compiled engine (:mod:`duetime.engine`) is the server's clock: one asyncio task steps it in
real time and releases each step's tokens when the step ends. ``duetime emulate`` runs one;
``duetime serve`` without a config runs three behind the gateway. See docs/gateway.md.
"""

from duetime.emulator.app import create_app
from duetime.emulator.core import FAULT_KINDS, Emulator, EmuRequest, Faults
from duetime.engine.frontend import FrontendModel

__all__ = ["FAULT_KINDS", "EmuRequest", "Emulator", "Faults", "create_app",
           "emulator_from_profile"]


def emulator_from_profile(profile: str, *, model_name: str | None = None, speed: float = 1.0,
                          seed: int = 0, faults: Faults | None = None,
                          output_median: float = 200.0,
                          enable_prefix_caching: bool = True,
                          frontend: FrontendModel | None = None) -> Emulator:
    """An emulator running a built-in engine profile (``duetime profiles``); prefix caching
    on unless ``enable_prefix_caching`` is False, as in vLLM; ``frontend``: an API server in
    front of its engine."""
    from duetime.engine.profiles import load_profile

    p = load_profile(profile)
    return Emulator(p.batch_time, p.config, model_name=model_name or profile, speed=speed, seed=seed,
                    faults=faults, output_median=output_median,
                    enable_prefix_caching=enable_prefix_caching, frontend=frontend)
