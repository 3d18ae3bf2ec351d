from quantcli.cli import main

main()
