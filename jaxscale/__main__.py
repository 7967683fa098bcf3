import sys

from jaxscale.cli.main import main

sys.exit(main())
