print("nothing to report")
