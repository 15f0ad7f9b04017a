import sys

from respo_verl.cpu.kit.build import main

sys.exit(main())
