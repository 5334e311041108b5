# kpl_add_module(NAME SOURCES... [PUBLIC_LINK libs...] [PRIVATE_LINK libs...])
#
# One of kpl's modules (../shared/DESIGN.md): a static library kpl_NAME
# whose public headers are its folder's *.h, plus kpl_NAME_internal, an
# interface target through which the module's own sources, tests and
# benches (never users) see its impl/ headers and the internal macros of
# kernels.h (KPL_INTERNAL).
function(kpl_add_module name)
  cmake_parse_arguments(PARSE_ARGV 1 M "" "" "PUBLIC_LINK;PRIVATE_LINK")
  set(lib kpl_${name})
  add_library(${lib} STATIC ${M_UNPARSED_ARGUMENTS})
  target_include_directories(${lib} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}
                                    PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/impl)
  target_compile_definitions(${lib} PRIVATE KPL_INTERNAL)
  target_link_libraries(${lib} PUBLIC ${M_PUBLIC_LINK} PRIVATE ${M_PRIVATE_LINK})
  add_library(${lib}_internal INTERFACE)
  target_include_directories(${lib}_internal INTERFACE ${CMAKE_CURRENT_SOURCE_DIR}/impl)
  target_compile_definitions(${lib}_internal INTERFACE KPL_INTERNAL)
  target_link_libraries(${lib}_internal INTERFACE ${lib})
endfunction()
