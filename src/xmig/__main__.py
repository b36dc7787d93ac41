from xmig.launch.cli import main

main()
