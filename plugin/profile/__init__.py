"""Router profiles: which experts a MoE model's router picks, and what slots would serve.

    from moeplug.profile import read_profile, merge_profiles, analyze
    profile = read_profile("model.profile.gguf")
    print(analyze(profile).overall_hit_rate("static", 32))
"""

from moeplug.profile.analysis import Analysis, analyze, default_slots
from moeplug.profile.format import (
    ModelFingerprint,
    Profile,
    ProfileError,
    ProfileSource,
    merge_profiles,
    model_fingerprint,
    read_profile,
    write_profile,
)

__all__ = ["Analysis", "ModelFingerprint", "Profile", "ProfileError", "ProfileSource", "analyze", "default_slots",
           "merge_profiles", "model_fingerprint", "read_profile", "write_profile"]
