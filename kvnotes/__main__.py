from kvnotes.cli import main

main()
