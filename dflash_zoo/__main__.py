from dflash_zoo.cli import main

main()
