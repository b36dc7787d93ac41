"""What a rank's state is made of: parameter fingerprints, per-step random state."""

from xmig.state.fingerprint import params_sha256
from xmig.state.rng import reseed, step_seed

__all__ = ["params_sha256", "reseed", "step_seed"]
