from jobtrail._cli import main

main()
