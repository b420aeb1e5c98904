"""covrl.explore."""
