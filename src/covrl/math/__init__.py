"""covrl.math."""
