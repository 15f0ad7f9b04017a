import sys

from respo_verl.cpukit.build import main

sys.exit(main())
