"""covrl.train."""
