"""The eviction policies compute serves, by name, for the `kvpop` commands'
help: kept here so that `kvpop generate` and `kvpop up` need no torch
(services/compute/eviction/policies.py POLICY_NAMES is the source; a test holds them equal)."""
POLICIES = ("dense", "learned", "streaming", "h2o", "tova", "snapkv", "knorm", "keydiff", "random")
