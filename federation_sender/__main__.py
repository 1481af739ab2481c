import sys

from federation_sender.cli import main

sys.exit(main())
