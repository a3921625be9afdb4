"""The database: the one layer that talks to asyncpg, the SQL files and their migrations."""
