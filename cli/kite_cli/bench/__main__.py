import sys

from kite_cli.bench import main

sys.exit(main())
