"""The background loops of an instance: the LISTEN connection, the sweep, the event hub."""
