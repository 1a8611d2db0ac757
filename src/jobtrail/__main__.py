from jobtrail._entry import main

main()
