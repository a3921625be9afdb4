"""The development stand-ins: what ``analysis-queue dev``, the demo, the tests and the
benchmarks use in place of what production is given. The Core simulator (``core_sim``, over
real HTTP) and the runs it keeps in the development database (``sim_runs``), the embedded
PostgreSQL (``embedded``), throwaway databases (``scratch``), and the writer of
``sql/schema.sql`` (``schema_file``). ``analysis-queue serve`` uses none of them."""
