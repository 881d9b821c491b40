"""python -m bench.peers [options]: see run.py."""
from .run import main

raise SystemExit(main())
