"""What every stage shares: files written atomically, paths local or remote, the device mesh, config files and defaults, the command lines' error handling, host memory."""
