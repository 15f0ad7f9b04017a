"""``python -m respo_verl.main_ppo algorithm=respo ...``: see :mod:`respo_verl.verl.main_ppo`."""

from respo_verl.verl.main_ppo import main

if __name__ == "__main__":
    main()
