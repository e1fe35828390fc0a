from ggpipe.frontends.cli import main

main()
