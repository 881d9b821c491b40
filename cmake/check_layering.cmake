# Include-layering check: every #include of a project header must point down the module stack
#
#   core <- plan <- {comm, kernels} <- model <- runtime <- planner <- {check, train} <- tools
#
# (a module may include its own headers and those of the modules it lists below; comm/kernels and
# check/train are siblings). Headers are named by path from src/ ("kernels/rope.h") or include/
# ("mlacp/config.h"); each public header belongs to the module listed in MLACP_PUBLIC_HEADERS.
# Because every allowed edge points strictly down, a passing tree has no include cycle.
#
# Usage: cmake -DROOT=<tree with src/ and include/> [-DSTAMP=<file touched on success>]
#              -P cmake/check_layering.cmake
# Scans ROOT/src/<module>/** and ROOT/include/mlacp/*; tools/ and tests/ may include anything.
# Fails (non-zero exit) with one line per wrong-way include:
#   src/kernels/rope.h:8 includes mlacp/config.h (model); kernels may include only core, plan
cmake_minimum_required(VERSION 3.18)

# --- the rule table: module -> the modules below it that it may include ----------------------
set(MLACP_MODULES core plan comm kernels model runtime planner check train)
set(MLACP_ALLOWED_core    "")
set(MLACP_ALLOWED_plan    core)
set(MLACP_ALLOWED_comm    core plan)
set(MLACP_ALLOWED_kernels core plan)
set(MLACP_ALLOWED_model   core plan comm kernels)
set(MLACP_ALLOWED_runtime core plan comm kernels model)
set(MLACP_ALLOWED_planner core plan comm kernels model runtime)
set(MLACP_ALLOWED_check   core plan comm kernels model runtime planner)
set(MLACP_ALLOWED_train   core plan comm kernels model runtime planner)
# Public headers (include/mlacp/) -> their module. A new public header must be added here.
set(MLACP_PUBLIC_HEADERS
  errors.h=core
  plan.h=plan
  memory.h=plan
  comm.h=comm
  c10d_groups.h=comm
  config.h=model
  attention.h=model
  checkpoint.h=model
  runtime.h=runtime
  planner.h=planner)

if(NOT DEFINED ROOT)
  message(FATAL_ERROR "check_layering: pass -DROOT=<source tree>")
endif()
get_filename_component(ROOT "${ROOT}" ABSOLUTE)

# The table itself must be a DAG pointing down: if a allows b, b may not allow a (and no module
# lists itself), so the rules cannot encode a cycle.
foreach(m IN LISTS MLACP_MODULES)
  foreach(below IN LISTS MLACP_ALLOWED_${m})
    if(below STREQUAL m OR NOT below IN_LIST MLACP_MODULES)
      message(FATAL_ERROR "check_layering: bad rule ${m} -> ${below}")
    endif()
    if(m IN_LIST MLACP_ALLOWED_${below})
      message(FATAL_ERROR "check_layering: rules ${m} -> ${below} and ${below} -> ${m} form a cycle")
    endif()
  endforeach()
endforeach()

# Module of an included header name ("kernels/rope.h", "mlacp/config.h"); "" if not ours.
function(mlacp_header_module header out)
  set(result "")
  if(header MATCHES "^mlacp/([^/]+)$")
    set(name "${CMAKE_MATCH_1}")
    set(result "?")
    foreach(entry IN LISTS MLACP_PUBLIC_HEADERS)
      if(entry MATCHES "^([^=]+)=(.+)$" AND CMAKE_MATCH_1 STREQUAL name)
        set(result "${CMAKE_MATCH_2}")
      endif()
    endforeach()
  elseif(header MATCHES "^([^/]+)/")
    if(CMAKE_MATCH_1 IN_LIST MLACP_MODULES)
      set(result "${CMAKE_MATCH_1}")
    endif()
  endif()
  set(${out} "${result}" PARENT_SCOPE)
endfunction()

function(mlacp_rule_text module out)
  if(MLACP_ALLOWED_${module})
    string(REPLACE ";" ", " list "${MLACP_ALLOWED_${module}}")
    set(${out} "${module} may include only ${list}" PARENT_SCOPE)
  else()
    set(${out} "${module} may include no other module" PARENT_SCOPE)
  endif()
endfunction()

set(problems "")
macro(mlacp_problem text)
  string(REPLACE ";" "@SEMICOLON@" _escaped "${text}")  # one list element per problem
  list(APPEND problems "${_escaped}")
endmacro()

file(GLOB_RECURSE src_files LIST_DIRECTORIES false RELATIVE "${ROOT}"
     "${ROOT}/src/*.h" "${ROOT}/src/*.hpp" "${ROOT}/src/*.cpp" "${ROOT}/src/*.cc" "${ROOT}/src/*.inc")
file(GLOB pub_files LIST_DIRECTORIES false RELATIVE "${ROOT}" "${ROOT}/include/mlacp/*")
list(SORT src_files)
list(SORT pub_files)
if(NOT src_files AND NOT pub_files)
  message(FATAL_ERROR "check_layering: no sources under ${ROOT}/src or ${ROOT}/include/mlacp")
endif()

foreach(rel IN LISTS pub_files src_files)
  # The module the file belongs to.
  if(rel MATCHES "^include/mlacp/([^/]+)$")
    mlacp_header_module("mlacp/${CMAKE_MATCH_1}" module)
    if(module STREQUAL "?")
      mlacp_problem("${rel} is a public header with no module: add it to MLACP_PUBLIC_HEADERS in cmake/check_layering.cmake")
      continue()
    endif()
  elseif(rel MATCHES "^src/([^/]+)/")
    set(module "${CMAKE_MATCH_1}")
    if(NOT module IN_LIST MLACP_MODULES)
      mlacp_problem("${rel} is in src/${module}/, which is not a module of the layering (cmake/check_layering.cmake)")
      continue()
    endif()
  else()
    mlacp_problem("${rel} is outside a module folder (src/<module>/)")
    continue()
  endif()

  file(READ "${ROOT}/${rel}" text)
  if(NOT text MATCHES "#[ \t]*include")
    continue()
  endif()
  # Split into lines without CMake's list syntax getting in the way of ; [ ] and \.
  string(REPLACE "\\" "/" text "${text}")
  string(REPLACE ";" "," text "${text}")
  string(REPLACE "[" "(" text "${text}")
  string(REPLACE "]" ")" text "${text}")
  string(REPLACE "\n" ";" lines "${text}")
  set(lineno 0)
  foreach(line IN LISTS lines)
    math(EXPR lineno "${lineno} + 1")
    if(NOT line MATCHES "^[ \t]*#[ \t]*include[ \t]*[\"<]([^\">]+)[\">]")
      continue()
    endif()
    set(header "${CMAKE_MATCH_1}")
    if(header MATCHES "(^|/)\\.\\.?/")
      mlacp_problem("${rel}:${lineno} includes ${header}: name project headers by path from src/ or include/, without ./ or ../")
      continue()
    endif()
    mlacp_header_module("${header}" to)
    if(to STREQUAL "")
      continue()  # not a project header (LibTorch, the standard library, ...)
    elseif(to STREQUAL "?")
      mlacp_problem("${rel}:${lineno} includes ${header}, a public header with no module: add it to MLACP_PUBLIC_HEADERS in cmake/check_layering.cmake")
    elseif(NOT to STREQUAL module AND NOT to IN_LIST MLACP_ALLOWED_${module})
      mlacp_rule_text(${module} rule)
      mlacp_problem("${rel}:${lineno} includes ${header} (${to}); ${rule}")
    endif()
  endforeach()
endforeach()

if(problems)
  list(LENGTH problems count)
  foreach(p IN LISTS problems)
    string(REPLACE "@SEMICOLON@" ";" p "${p}")
    message(NOTICE "${p}")
  endforeach()
  message(NOTICE "Layering: core <- plan <- {comm, kernels} <- model <- runtime <- {check, train} <- tools "
                 "(lower may not include higher; rules in cmake/check_layering.cmake)")
  message(FATAL_ERROR "layering check failed: ${count} problem(s) under ${ROOT}")
endif()
if(DEFINED STAMP)
  file(TOUCH "${STAMP}")
endif()
