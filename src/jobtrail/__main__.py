from jobtrail.interfaces.entry import main

main()
