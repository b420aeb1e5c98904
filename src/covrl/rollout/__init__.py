"""covrl.rollout."""
