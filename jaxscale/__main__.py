import sys

from jaxscale.cli import main

sys.exit(main())
