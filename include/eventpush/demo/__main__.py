from eventpush.demo.story import main

main()
