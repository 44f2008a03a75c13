from fleetd.cli import main

main()
