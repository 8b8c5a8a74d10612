"""Small parts every room uses: errors and exit codes, paths, atomic files, output, progress, sizes, logs."""
