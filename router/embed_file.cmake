# Turns a file into a C source defining `const unsigned char NAME[]` (the bytes plus a NUL, which
# NAME_len does not count) and `const size_t NAME_len`. Run as
#   cmake -DIN=file -DOUT=file.c -DNAME=symbol -P embed_file.cmake
# so the router carries its status page without reading anything at run time.
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
math(EXPR len "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
# 16 bytes per line keeps the generated file readable in a debugger
string(REGEX REPLACE "((0x[0-9a-f][0-9a-f],){16})" "\\1\n    " bytes "${bytes}")
file(WRITE "${OUT}.tmp"
  "/* Generated from ${IN} by embed_file.cmake: do not edit. */\n"
  "#include <stddef.h>\n"
  "const unsigned char ${NAME}[] = {\n    ${bytes}0x00\n};\n"
  "const size_t ${NAME}_len = ${len};\n")
file(RENAME "${OUT}.tmp" "${OUT}")
