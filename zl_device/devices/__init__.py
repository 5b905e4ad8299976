"""Device backends (local processes, phones over adb, the app), `--devices` parsing, deploy and the network plan."""
