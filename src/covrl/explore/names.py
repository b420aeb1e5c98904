"""Names of the bandit environments and agents (stdlib only, so the CLI can list them without importing torch).
They mirror the registries `covrl.explore.envs.ENVS` and `covrl.explore.loop.AGENTS` (a test checks this)."""

ENV_NAMES = ("linear", "sphere", "quadratic", "neural", "classification", "lm")
AGENT_NAMES = ("ensemble++", "lints", "ensemble-sampling", "linear-greedy", "neural-ensemble++", "ensemble+",
               "epinet", "greedy")
