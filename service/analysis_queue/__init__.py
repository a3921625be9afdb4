"""analysis-queue: a per-user analysis queue on PostgreSQL."""
