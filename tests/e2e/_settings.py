"""The session stack's settings (``conftest.py`` starts the stack with them; tests that wait
out a lease or fill the decode's cache read them here)."""

# Short enough that the stalled-transfer test finishes quickly, long enough that a healthy read
# on a loaded 2-core machine never trips it.
KV_READ_TIMEOUT = 5.0
# Decode retention lease: short, so that expiry and keepalive are testable in seconds; long
# enough that the gap between two turns of a test (a reference run, a few legs) stays inside it.
RETENTION_TTL = 12.0
# A small decode cache (blocks of 128 tokens) so that budgets and memory pressure are reachable
# with the tiny model; retentions may hold a quarter of it.
DECODE_BLOCKS = 400
RETENTION_BUDGET = 0.25
# The prefill's reuse cost model, pinned so that every verified range is read: these tests
# prove reads and their outcomes, which must not hang on timings. Measured on this stack
# (scripts/measure_reuse_cost.py), "auto" read every verified 128-token block too, at 4-7 ms
# against 9-25 ms to compute it: a margin that a loaded 2-core host could flip. At 1 token/s
# computing is always dearer. Only compute is pinned: the read side still calibrates from the
# real reads and NIXL telemetry, which test_connector checks; "auto" is unit-tested.
PREFILL_CONNECTOR_EXTRA = {"compute_tokens_per_s": 1.0}
# Two LoRA adapters of the tiny model, built locally (seeded) and served by every instance, so
# that a conversation can switch adapter between turns (test_extra_keys.py). With LoRA on, a
# request without an adapter runs the base model unchanged.
ADAPTERS = {"adapter-a": 1, "adapter-b": 2}
LORA_RANK = 8
# Each member on its own address (all of 127.0.0.0/8 is loopback): the README's multi-host
# recipe on one machine. 127.0.0.1 is left to servers that tests start beside the stack.
HOSTS = {"router_host": "127.0.0.2", "prefill_host": "127.0.0.3", "decode_host": "127.0.0.4",
         "reference_host": "127.0.0.5"}

