"""covrl.tasks."""
