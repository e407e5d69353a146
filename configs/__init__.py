"""The shipped configs, each a file with get_config(): `--config=NAME` names configs/NAME.py from any
directory. Installed, they are the package gspmd_tp.configs (gspmd_tp/configs links here in a
checkout), so a config of one's own starts from one with `from gspmd_tp.configs import tiny`."""
